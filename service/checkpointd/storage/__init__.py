"""The storage seam: where committed saves live, with the save manifest as the commit marker.

`local` keeps them on a local (or mounted) filesystem; `s3` is a package
with one public face that keeps them in an S3 bucket. `save_manifest`,
`prefix` and `ownership` are what both share; `verify` checks local saves
against their manifests (`checkpointd verify`).
"""
