"""eyas_synth: stage 01, prompts -> served target -> token-exact samples."""
