"""Process plumbing that no part of the design owns: the fork server that workers and
inference server processes start from (:mod:`~torchrl_asyncpool._sys.forkserver`), file
descriptors handed to them (:mod:`~torchrl_asyncpool._sys.descriptors`), CPU affinity
(:mod:`~torchrl_asyncpool._sys.affinity`), daemon threads (:mod:`~torchrl_asyncpool._sys.threads`),
optional modules known to be absent (:mod:`~torchrl_asyncpool._sys.absent_modules`) and the
lazy exports of the packages (:mod:`~torchrl_asyncpool._sys.lazy_exports`).

It is the bottom layer: it imports nothing else of this package, and importing it imports no
torch.
"""
