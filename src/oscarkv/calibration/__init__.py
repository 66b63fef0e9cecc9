"""Offline calibration: statistics, rotation algebra and the rotations artifact."""
