"""`python -m eyas_train` = `eyas-train`, so that `torchrun -m eyas_train run ...` works."""

from eyas_train.cli import main

main()
