#!/bin/bash
set -eu
grep -rhoE 'ACCESS-CODE: [0-9a-f]+' logs | cut -d' ' -f2 > answer.txt
