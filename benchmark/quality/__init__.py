"""Output quality on real weights: the span server and sparse decoding against references."""
