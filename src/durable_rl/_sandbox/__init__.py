"""OS-level sandboxes for trials: private working copies of snapshots, limited commands, tools.

No engine, no CLI: units and environments use it; the engine only passes settings in.
"""
