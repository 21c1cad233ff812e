"""The one-shot check for the GPU machine (gpu/check.sh) and what it needs to travel there."""
