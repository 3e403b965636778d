"""The target model: finding, fetching and loading it, the machine it runs on, its forward pass and kernels,
batch invariance, chat templates."""
