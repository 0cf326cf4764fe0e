import pytest

from tests.support.isolated import IsolatedProcess


@pytest.fixture(scope="session")
def isolated():
    """A long-lived separate process for test bodies that might touch released memory."""
    proc = IsolatedProcess()
    yield proc
    proc.close()
