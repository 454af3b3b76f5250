"""Remote env hosts: envs on other machines feed a pool's slots over a gRPC stream.

:class:`RemoteEnvSlot` is the pool side of one env per stream (protocol 1), :class:`EnvHost`
its host side; :class:`RemoteVectorSlot` and :class:`VectorEnvHost` serve ``k`` envs over one
stream (protocol 2). :mod:`torchrl_asyncpool.remote.protocol` is the wire format. Needs
``grpcio`` (``pip install 'torchrl-asyncpool[remote]'``).
"""
from torchrl_asyncpool.remote.host import EnvHost, RemoteHostError
from torchrl_asyncpool.remote.slot import RemoteEnvSlot
from torchrl_asyncpool.remote.vector_host import VectorEnvHost
from torchrl_asyncpool.remote.vector_slot import RemoteVectorSlot

__all__ = ["RemoteEnvSlot", "EnvHost", "RemoteHostError", "RemoteVectorSlot", "VectorEnvHost"]
