"""Accuracy evaluation on one harness."""
