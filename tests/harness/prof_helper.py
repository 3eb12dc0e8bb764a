import cProfile, time
def run(rank, world, fn_path, out, **kw):
    import importlib
    mod, fn = fn_path.rsplit(":", 1)
    f = getattr(importlib.import_module(mod), fn)
    pr = cProfile.Profile()
    t = time.time()
    pr.enable()
    r = f(rank, world, **kw)
    pr.disable()
    if rank == 0:
        pr.dump_stats(out)
    return time.time() - t
