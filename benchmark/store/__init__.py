"""The prefix tensor store: its data plane, its lookups beside the scheduler, TTFT through it."""
