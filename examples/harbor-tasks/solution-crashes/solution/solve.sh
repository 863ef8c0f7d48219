#!/bin/bash
echo "about to crash" >&2
kill -SEGV $$
echo done > done.txt
