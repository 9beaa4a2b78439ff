"""The on-disk format, bytes in and values out: no location I/O (that is :mod:`torchrl_dcp.storage`).

- :mod:`~torchrl_dcp.format.layout`: file names, size limits, the identity trailer;
- :mod:`~torchrl_dcp.format.record`: the ``torch.save`` record of one tensor (build, parse);
- :mod:`~torchrl_dcp.format.zipformat`: ZIP headers (records and archives);
- :mod:`~torchrl_dcp.format.checksums`: CRC-32 arithmetic and content fingerprints;
- :mod:`~torchrl_dcp.format.codec`: JSON skeletons of component state and tensor specs;
- :mod:`~torchrl_dcp.format.manifest` (+ ``manifest_depth``): the manifest schema, its seal, migrations;
- :mod:`~torchrl_dcp.format.dcp_metadata`: DCP's ``.metadata`` parsed without running code, and spliced from ranks' parts;
- :mod:`~torchrl_dcp.format.metadata_checks`: what parsed metadata must satisfy (bounds, coverage, inventory).
"""
