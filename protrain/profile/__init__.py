"""Profiles: what the cost models know about the model (ModelProfile: measured by
``tracer.profile_model`` or estimated by ``analytic.analytic_profile``) and the machine
(HardwareProfile: measured by ``probe.probe_hardware`` or published in ``machines``)."""
