#!/bin/bash
# reward.json: one reward per field, and their mean as the reward.
python3 - <<'PY'
import json, os
out = os.path.join(os.environ["LOGS_DIR"], "verifier", "reward.json")
try:
    report = json.load(open("report.json"))
except (OSError, ValueError):
    report = {}
count = 1.0 if report.get("count") == 6 else 0.0
total = 1.0 if report.get("total") == 108 else 0.0
json.dump({"reward": (count + total) / 2, "count": count, "total": total}, open(out, "w"))
PY
