"""Inference with compiled torch models: `predict` (a loader's batches through the model, split over
the processes) and `generate` (Hugging Face generation, bucketed)."""
