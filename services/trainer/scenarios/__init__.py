"""Training scenarios a trainer can run as one stage of a split model."""
