"""Prices (prices.py and the dated snapshot in pricing_data/), what a run cost (cost.py) and its plot."""
