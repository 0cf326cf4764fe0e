def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "te_gpu: needs Transformer Engine and a CUDA GPU; runs (and must pass) wherever both "
        "exist, skipped with the missing piece named otherwise",
    )
