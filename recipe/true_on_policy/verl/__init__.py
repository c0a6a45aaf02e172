"""verl adapter: the only package of true_on_policy that imports verl.

    register.py      the module verl imports in every process (``verl.plugins`` entry
                     point, or VERL_USE_EXTERNAL_MODULES=true_on_policy.verl.register)
    cpu_support.py   stock verl 0.9.1 on a host with no accelerator (inert otherwise)
    platform_cpu.py  verl's platform interface for CPU (gloo, torch.cpu, no IPC)
    hooks.py         post-import hooks: act on a verl module right after verl imports it

Importing this package does nothing; ``register`` is the hook.
"""
