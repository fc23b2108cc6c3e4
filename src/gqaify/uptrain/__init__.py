"""Short uptraining of a converted model under `accelerate launch` (not built yet: see the uptrain issue)."""
