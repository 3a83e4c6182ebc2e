"""fastpipe: pipeline-parallel training for PyTorch."""
