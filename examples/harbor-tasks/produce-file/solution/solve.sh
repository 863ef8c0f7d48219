#!/bin/bash
set -eu
python3 - <<'PY'
import json
nums = [int(line) for line in open("numbers.txt") if line.strip()]
json.dump({"count": len(nums), "total": sum(nums)}, open("report.json", "w"))
PY
