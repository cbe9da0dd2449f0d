"""Tempered SMC for CRFs: log Z and marginals of any CRF the Gibbs engine compiles.

    sampler.py            TemperedSMC: anneal from the prior to the posterior
    target.py             the tempered target p_beta, compiled from the CRF
    tempering.py          the particle systems and one step: next beta, reweigh, resample, move
    gibbs_moves.py        the batched block-Gibbs sweeps that leave p_beta invariant
    collapsed_weights.py  the collapsed head and global passes the sweeps draw from

``inference.TemperedSMC`` is the public name.
"""
