"""The lab: experiments, the side by side and its peers, kernel and engine benchmarks,
the built-in model's training. None of it is product code: `tandem bench` and `tandem
tune` are bench/, and nothing outside bench/lab imports it."""
