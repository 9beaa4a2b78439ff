"""Where bytes go: DCP readers/writers, checksums and the atomic commit of a directory."""
