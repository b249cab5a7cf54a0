"""nopelens: where does a transformer know where a token is?

Subpackages (data flows one way, left to right):
    nopelens.models     small hooked decoders, position methods, tasks, training, adapters
    nopelens.circuits   hand-set NoPE circuits with known answers (Kazemnejad et al. 2023)
    nopelens.probes     activation collection, position probes, attention-sink metrics
    nopelens.analyses   sweeps, audits, length generalization, the `nopelens` CLI
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nopelens")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
