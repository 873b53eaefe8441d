#!/bin/bash
sed -i 's|sum(xs) // len(xs)|sum(xs) / len(xs)|' /app/stats.py
