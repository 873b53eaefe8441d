#!/bin/bash

# Use this file to solve the task.
echo "Hello, world!" > /app/hello.txt
