"""Integrations with inference frameworks."""
