"""ABNet-cloud on real Spanish->English text: pre-training and adapter fine-tuning jobs."""
