#!/bin/bash
# The verifier's own copy of the test: an agent that edits the test gains nothing.
cp "$TESTS_DIR/test_stats.py" test_stats.py
if python3 -m unittest -q test_stats 2>"$LOGS_DIR/verifier/unittest.txt"; then
  echo 1 > "$LOGS_DIR/verifier/reward.txt"
else
  echo 0 > "$LOGS_DIR/verifier/reward.txt"
fi
