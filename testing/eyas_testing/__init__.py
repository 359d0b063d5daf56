"""eyas_testing: what the tests, the benchmarks and the demo use and no stage image ships: the tiny offline
targets (fixtures), a fake OpenAI server with fault injection, and launchers for real servers."""

__version__ = "0.1.0"
