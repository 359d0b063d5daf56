"""eyas stage 04: serve a target with its EAGLE-3 draft, measure acceptance and speedup."""
