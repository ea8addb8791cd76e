"""The draft-length policy and the cost curves it prices blocks with."""
