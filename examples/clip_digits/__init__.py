"""Building blocks of examples/train_clip.py: a tiny CLIP trained on scikit-learn's digits."""
