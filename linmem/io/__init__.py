"""File IO shared by data, eval, train and zoo: SHA-256 manifests of folders and the guard on output folders."""
