"""Remote env hosts: envs on other machines feed a pool's slots over a gRPC stream.

:class:`RemoteEnvSlot` is the pool side (a factory returns one per slot), :class:`EnvHost` the
host side, :mod:`torchrl_asyncpool.remote.protocol` the wire format. Needs ``grpcio``
(``pip install 'torchrl-asyncpool[remote]'``).
"""
from torchrl_asyncpool.remote.host import EnvHost, RemoteHostError
from torchrl_asyncpool.remote.slot import RemoteEnvSlot

__all__ = ["RemoteEnvSlot", "EnvHost", "RemoteHostError"]
