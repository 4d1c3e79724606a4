"""attn_bwd_sm90_tiling.py — a block-level model of kernels/attn/attn_bwd_sm90.cu's schedule, checked
against dense float64 attention gradients (no roundings, so agreement is to ~1e-15).

It walks the kernels' loops as written: CTA pairs of 128-row resident tiles (i and n-1-i, the middle
one alone), the dK/dV kernel's steps over the group's query heads and 64-query tiles from the
resident tile's first key, the dQ kernel's 64-key tiles from the last one down to 0, the consumer
warpgroups' skip (wholly masked) and diagonal (elementwise mask) cases, the 3-D TMA boxes'
zero fill past T, the workspace's padded rows (lse2 = +inf, D = 0) and the stores of rows < T.
What it cannot check is the hardware side: descriptors, fragment layouts, barriers.

    python3 tests/attn_bwd_sm90_tiling.py     (needs numpy; a few seconds)
"""
import numpy as np, math, sys
def ref(q,k,v,dy,B,T,H,Hkv,dh):
    grp=H//Hkv; c=1/math.sqrt(dh)
    dq=np.zeros_like(q); dk=np.zeros_like(k); dv=np.zeros_like(v); lse=np.zeros((B,H,T)); D=np.zeros((B,H,T))
    for b in range(B):
        for h in range(H):
            g=h//grp
            S=q[b,:,h]@k[b,:,g].T*c
            S[np.triu_indices(T,1)]=-np.inf
            m=S.max(1,keepdims=True); P=np.exp(S-m); l=P.sum(1,keepdims=True); P/=l
            lse[b,h]=(m+np.log(l))[:,0]
            y=P@v[b,:,g]; D[b,h]=(dy[b,:,h]*y).sum(1)
            dP=dy[b,:,h]@v[b,:,g].T; dS=P*(dP-D[b,h][:,None])
            dq[b,:,h]=c*dS@k[b,:,g]; dk[b,:,g]+=c*dS.T@q[b,:,h]; dv[b,:,g]+=P.T@dy[b,:,h]
    return dq,dk,dv,lse,D
def sim(q,k,v,dy,lse,D,B,T,H,Hkv,dh):
    grp=H//Hkv; c=1/math.sqrt(dh); l2e=1/math.log(2); sl2=l2e*c
    Tp=(T+127)//128*128
    lse2=np.full((B,H,Tp),np.inf); dsum=np.zeros((B,H,Tp))
    lse2[:,:,:T]=lse*l2e; dsum[:,:,:T]=D
    def box(x,b,hd,y,rows):  # 3-D TMA box, zero fill past T
        out=np.zeros((rows,dh)); n=max(0,min(rows,T-y)); out[:n]=x[b,y:y+n,hd]; return out
    dq=np.full_like(q,np.nan); dk=np.full_like(k,np.nan); dv=np.full_like(v,np.nan)
    ntiles=(T+127)//128; npairs=(ntiles+1)//2; nq=(T+63)//64
    # dkv
    for b in range(B):
      for g in range(Hkv):
        for x in range(npairs):
          passes=1 if 2*x+1==ntiles else 2
          for ps in range(passes):
            tile=x if ps==0 else ntiles-1-x; k0=tile*128; per_h=nq-k0//64
            K=box(k,b,g,k0,128); V=box(v,b,g,k0,128)
            acc_k=[np.zeros((64,dh)) for _ in range(2)]; acc_v=[np.zeros((64,dh)) for _ in range(2)]
            for s in range(grp*per_h):
              h=g*grp+s//per_h; q0=k0+(s%per_h)*64
              Q=box(q,b,h,q0,64); DY=box(dy,b,h,q0,64); L=lse2[b,h,q0:q0+64]; DD=dsum[b,h,q0:q0+64]
              assert len(L)==64
              for cw in range(2):
                kw=k0+64*cw
                if not q0>=kw: continue
                St=K[64*cw:64*cw+64]@Q.T; dPt=V[64*cw:64*cw+64]@DY.T
                with np.errstate(invalid='ignore'):
                  P=np.exp2(St*sl2-L[None,:])
                if q0==kw:
                  r=np.arange(64)[:,None]; cc=np.arange(64)[None,:]; P[r>cc]=0
                dS=P*(dPt-DD[None,:])
                acc_v[cw]+=P@DY; acc_k[cw]+=dS@Q
            for cw in range(2):
              for rr in range(64):
                row=k0+64*cw+rr
                if row<T: dk[b,row,g]=acc_k[cw][rr]*c; dv[b,row,g]=acc_v[cw][rr]
    # dq
    for b in range(B):
      for h in range(H):
        g=h//grp
        for x in range(npairs):
          passes=1 if 2*x+1==ntiles else 2
          for ps in range(passes):
            tile=x if ps==0 else ntiles-1-x; q0=tile*128; last=(min(q0+128,T)-1)//64
            Q=box(q,b,h,q0,128); DY=box(dy,b,h,q0,128); L=lse2[b,h,q0:q0+128]; DD=dsum[b,h,q0:q0+128]
            assert len(L)==128
            acc=[np.zeros((64,dh)) for _ in range(2)]
            for j in range(last,-1,-1):
              Kt=box(k,b,g,j*64,64); Vt=box(v,b,g,j*64,64)
              for cw in range(2):
                r0=q0+64*cw
                if not j*64<=r0: continue
                S=Q[64*cw:64*cw+64]@Kt.T; dP=DY[64*cw:64*cw+64]@Vt.T
                P=np.exp2(S*sl2-L[64*cw:64*cw+64,None])
                if j*64==r0:
                  r=np.arange(64)[:,None]; cc=np.arange(64)[None,:]; P[cc>r]=0
                dS=P*(dP-DD[64*cw:64*cw+64,None]); acc[cw]+=dS@Kt
            for cw in range(2):
              for rr in range(64):
                row=q0+64*cw+rr
                if row<T: dq[b,row,h]=acc[cw][rr]*c
    return dq,dk,dv
rng=np.random.default_rng(1)
bad=0
for (B,T,H,Hkv,dh) in [(1,1,2,1,64),(2,17,4,2,64),(1,65,2,2,128),(2,129,14,2,64),(1,256,8,2,64),(1,257,4,1,128),(1,300,2,1,64),(1,333,8,4,128),(1,700,7,1,64)]:
    q=rng.standard_normal((B,T,H,dh)); k=rng.standard_normal((B,T,Hkv,dh)); v=rng.standard_normal((B,T,Hkv,dh)); dy=rng.standard_normal((B,T,H,dh))
    dq,dk,dv,lse,D=ref(q,k,v,dy,B,T,H,Hkv,dh)
    sq,sk,sv=sim(q,k,v,dy,lse,D,B,T,H,Hkv,dh)
    # NaN (an unwritten row) or a difference past float64 noise fails
    e=[np.linalg.norm(a-b)/(1+np.linalg.norm(a)) for a,b in ((dq,sq),(dk,sk),(dv,sv))]
    ok=all(x<1e-9 for x in e)
    bad+=not ok
    print("B %d T %4d H %2d Hkv %d dh %3d: |d| / (1 + |ref|) dq %.1e dk %.1e dv %.1e %s"%(B,T,H,Hkv,dh,*e,"ok" if ok else "WRONG"))
sys.exit(1 if bad else 0)
