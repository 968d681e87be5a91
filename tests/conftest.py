"""Settings for the whole suite."""

from hypothesis import HealthCheck, settings

# CI runs mypy beside pytest on two cores: a property test's example may pause for longer than
# hypothesis's default 200 ms deadline, which would fail it on timing, not on a property.
settings.register_profile(
    "suite", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("suite")
