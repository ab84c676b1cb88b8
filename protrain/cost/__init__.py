"""Cost models, pure functions of (profiles, plan): ``layout`` packs parameters into chunks,
``memory`` predicts peak device and host bytes, ``time_model`` predicts iteration time."""
