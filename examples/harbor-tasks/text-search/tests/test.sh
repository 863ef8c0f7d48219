#!/bin/bash
# Reward 1 when answer.txt holds the access code, else 0.
if [ "$(cat answer.txt 2>/dev/null)" = "7f3a9c" ]; then
  echo 1 > "$LOGS_DIR/verifier/reward.txt"
else
  echo 0 > "$LOGS_DIR/verifier/reward.txt"
fi
