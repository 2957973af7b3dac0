"""splitkv: generated split-KV ("flash-decoding") decode attention for NVIDIA GPUs."""
