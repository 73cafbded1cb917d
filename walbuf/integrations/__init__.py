"""Integrations with training frameworks; each needs its own extra (walbuf[lightning], [transformers], [accelerate])."""
