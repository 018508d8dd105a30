"""The switch: each cluster's only outward-facing process (mTLS WAN gateway + internal relay)."""
