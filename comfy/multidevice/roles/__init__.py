"""Which card runs which component (the role plan) and how each component is set up for its role."""
