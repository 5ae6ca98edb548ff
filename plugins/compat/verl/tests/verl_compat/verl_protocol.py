"""``verl.protocol`` for verl's own DataProto tests, answered by ``rlplat.protocol``.

``make test-verl-compat`` installs this module as ``sys.modules["verl.protocol"]`` before verl is
imported (see ``verl_alias.py``), so ``from verl import DataProto`` and every
``from verl.protocol import ...`` in verl's test file get rlplat's objects. Nothing is adapted here:
a name verl's tests need and rlplat lacks must fail, not be papered over.
"""

from rlplat.protocol import *  # noqa: F403
from rlplat.protocol import __all__  # noqa: F401

