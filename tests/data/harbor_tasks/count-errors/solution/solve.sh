#!/bin/bash
grep -c ERROR /app/server.log > /app/answer.txt
