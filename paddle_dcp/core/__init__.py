"""The pure core: boxes, nested state dicts, dtypes, the metadata model and file names, save
and load planning, the aoa mapping. Imports only the standard library, numpy, ``errors`` and
each other; never paddle."""
