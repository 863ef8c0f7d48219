#!/bin/bash
set -eu
sed -i 's|(len(xs) + 1)|len(xs)|' stats.py
