#!/bin/bash
echo "definitely not a number" > "$LOGS_DIR/verifier/reward.txt"
