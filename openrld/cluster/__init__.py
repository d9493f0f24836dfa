"""Everything that spans nodes: membership, placement, the job directory, the relay and the peer client.

`node.ClusterNode` is the package's face: the daemon builds one for a node with
a cluster secret, and the HTTP front calls it (its relay, its membership for
the peer API and the cluster view). Like `actors/`, nothing here imports torch.
"""
