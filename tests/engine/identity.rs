//! Nothing users see changes when the engine's insides move: for 5 prompts ×
//! 7 policies (full, window, h2o, snapkv, adakv, epikv, epikv-lag) at a
//! budget every one of them must evict under, the SHA-256 of the greedy token
//! ids and of the f32 logits at every position (each prompt position, then
//! each decoded step) must equal the hashes recorded before the device-seam
//! redesign (on commit 00f5acf).
//!
//! Floating-point results depend on which kernels the CPU runs (the SIMD
//! attention/GEMM paths sum in another order than the portable ones), so
//! hashes are recorded per kernel profile: portable (then called avx2) on
//! 00f5acf; avx512 and avx512-vnni later, once an AVX-512 machine had
//! checked the first ones at `KVRUN_CPU=avx2`; avx2 when the AVX2 decode
//! attention kernel landed (checked against portable's recorded hashes:
//! the greedy tokens, see the test). The avx512-vnni logit hashes were
//! re-recorded on 2026-12-04 when Q8_0 (the default model's tied output
//! head) got its own VNNI arithmetic (`qgemm_q8_0_tokens`: one float step per
//! block instead of ggml's 8 lanes): every greedy token hash stayed the
//! same. The avx2 and avx512 logit hashes were re-recorded on 2026-12-06
//! when Q8_0 took the same arithmetic there (`qgemm_q8_0_tokens`'s AVX2
//! kernels): every greedy token hash stayed the same. The test reruns
//! itself at every lower level the CPU runs. A profile without recorded
//! hashes still checks what it can on its own: two runs of every case are
//! identical, and the run is identical with 1 and 2 threads.

use crate::util;

use clap::Parser;
use kvrun::cmd::args::KvArgs;
use kvrun::format::gguf::Gguf;
use kvrun::model::llama::Logits;
use kvrun::model::Weights;
use kvrun::sample::argmax;
use kvrun::tokenizer::Tokenizer;
use sha2::{Digest, Sha256};

#[derive(Parser, Debug)]
struct Flags {
    #[command(flatten)]
    kv: KvArgs,
}

const PROMPTS: [&str; 5] = [
    "The quick brown fox jumps over the lazy dog. In the beginning the universe was created; this has made a lot of people very angry and been widely regarded as a bad move.",
    "Question: A train leaves the station at 3 pm travelling at 60 miles per hour. A second train leaves at 4 pm at 80 miles per hour. When does the second train catch up? Answer:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return",
    "Robert Boulter is an English film, television and theatre actor. He had a guest starring role on the television series The Bill in 2000. This was followed by",
    "List three facts about the Moon:\n1. The Moon orbits the Earth about once every 27 days.\n2.",
];

const POLICIES: [&str; 7] = [
    "full",
    "window",
    "h2o",
    "snapkv",
    "adakv",
    "epikv",
    "epikv-lag",
];

const BUDGET: usize = 80;
const N_GEN: usize = 80;

/// (profile, prompt index, policy, sha256(tokens), sha256(logits)).
const RECORDED: &[(&str, usize, &str, &str, &str)] = &[
    (
        "portable",
        0,
        "full",
        "a44dc035a60e95ddcc6bb0dfccd044ba796474f1a2efec62157e19eab2d6fb44",
        "e9ac5d6d48d4442e80353dc86fadc07ee88d9455af8e1d1ebfe8fe588bb5c471",
    ),
    (
        "portable",
        0,
        "window",
        "6bd99732bca85a19653c4642e8c4ac7eb16f845cb8b1e544aeaaa323abc03bac",
        "3c3665de01bcf66f25b7c5e05194b632077612581799f5c4100df752d1d47d9a",
    ),
    (
        "portable",
        0,
        "h2o",
        "c91df3599f11d9a72d1332a9d0fa24fb11dbf703ebca7566309e1f3b555ccd9d",
        "41c840edf2559194ab86ec39759802c30b8e24f829419ba60a227d1bb36e51f3",
    ),
    (
        "portable",
        0,
        "snapkv",
        "079f43a1935a155e95d4ae3cecc5455e37ae62bd985449a09d113ed5f646d5af",
        "c899d9018237c51d427cde805f41d5d5537241df0a737b56ed8346a70d7bbd42",
    ),
    (
        "portable",
        0,
        "adakv",
        "50722c851146a27ae57df8a9b5669478c096c2b12aea1a89d592ccb5b67d7c18",
        "752f226e9f9fe3ad90821c3e025b8160b7865841601a21749acd478af034c814",
    ),
    (
        "portable",
        0,
        "epikv",
        "580b1c07da313e1f191355e429a3fdb0957beca054f3f840e50b769dc42c6c3d",
        "85228ea2012f5ba5f97175e69a383b4074f913bf9eef8d54fe89b213b9ae8960",
    ),
    (
        "portable",
        0,
        "epikv-lag",
        "5851f19bcac18766ec3585f899449825847e9b7084ab1f02b8bf353d6f1124fd",
        "b617ff2934ee86d8d274f9a1910eae476858a919a6ba2f0bd1e16cd7bcb8f326",
    ),
    (
        "portable",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "1513ce41c2321ec03402a73359afff4194b3d60aa45a35666cf0fc42028295ed",
    ),
    (
        "portable",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "b99562bc829ec35db638024066390e0d131b9c83846040d11404159e4c85d60e",
    ),
    (
        "portable",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "3917210e94f23ab6562291e02243fc22b3eeb675d5f0880e5e4f0fcf0a2a2be2",
    ),
    (
        "portable",
        1,
        "snapkv",
        "eaab55581e1b0ebbfa46c8d51736ad18f76db43d4ac57715f5b86d6257ec616a",
        "ec59d1d093f791c4fba4eade83dc6bc65e4500eb498bc03789f9795e9751040e",
    ),
    (
        "portable",
        1,
        "adakv",
        "131594903ea79c10386f4c0fd11712d4e99c6dcf2169ee903406c5ad15282bac",
        "449f51c20de79f983c5578537f0bdb9c60722b25159cb2e5265c5d5b737d0c21",
    ),
    (
        "portable",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "7ed697dc7891edd892647d531ac26907b4487f0f4a7a7171e53cf98fde15371b",
    ),
    (
        "portable",
        1,
        "epikv-lag",
        "01ddc294582b1ac3b6a4a87a54d3cea25b0aa2238849d740d1f15d463498d32f",
        "ec75406962cf01ad056c2d589ecf9b3daf17fb440f291d86cfd31fd8120034b2",
    ),
    (
        "portable",
        2,
        "full",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "3e3a1842b9a9dc5796995b706777ecef022f446de630ff110066de50064522d4",
    ),
    (
        "portable",
        2,
        "window",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "9f0a0cfd6458808c6a42c02a6642e594b977a110e390689e1edd7337a1c42fbc",
    ),
    (
        "portable",
        2,
        "h2o",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "059b89404f6e127b74843cc59ce2924ec68b5b12737f6a547c408e9ec29743cc",
    ),
    (
        "portable",
        2,
        "snapkv",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "0a47f74be5ac9f30b8c1450ed82b1e923c9bf2c82011c37a6b347917d345b8da",
    ),
    (
        "portable",
        2,
        "adakv",
        "8004acba269021bf8fe6fb0dd96326002cb3e0438f89b33a88d36af5febe041f",
        "0954eac527b2e47bb0655ecfc2f597ec0635c4d814eb3b5988cdf88efb8ba3cf",
    ),
    (
        "portable",
        2,
        "epikv",
        "2348d081d133c1cc3140d728e58e625be7f728dc2c9d7d648460b40d588b3c49",
        "75ec2f9d5c81a113827a12637b32200d981f819e185af4912118c4ca50797c18",
    ),
    (
        "portable",
        2,
        "epikv-lag",
        "e39cc1b2e9968b87942c3690e5137c838fc99276428cf69b02d93c33988bfd77",
        "9e8a04f1663538b976eccd02bf39279074de09075a1d7a906be2abd6064ab647",
    ),
    (
        "portable",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "59b9f9061f6eab0e73c2863b7349b3fd3bab3e2e6d48b35dbe460417ddea3144",
    ),
    (
        "portable",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "dd16c2feca3f375b70d67cec26132cb6d570b5fff8561ba5deb09b784edbc7ff",
    ),
    (
        "portable",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "41bde999a7a86cbf6863043333658ce8007736b5464afaa39ca20231bb86557a",
    ),
    (
        "portable",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "f6505d55fb88ebc89ef1e1dc6d5c2076af274ced6bfb563d0749e8ac613f3d5f",
    ),
    (
        "portable",
        3,
        "adakv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "d9e1dda81ac4f87633df245ad69fb04960b56a71afd25c4b0ef2816cac78e926",
    ),
    (
        "portable",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e468a03f16141ea7015a6fc720f334df858161247e34a71ad32da26ebdc6b168",
    ),
    (
        "portable",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "56b9d6031c13078c4471ed51967b19d4a56ba61ad8094312aba4be22a4882c6b",
    ),
    (
        "portable",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "65963c712155486643ef7f0187081040c3bb79ac062fa5f98a4e0e09abda2120",
    ),
    (
        "portable",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "a5a11c2fd26c74105b50902f555fd7707f7051528e028764d16a35d7465ec4bf",
    ),
    (
        "portable",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0968403d44174c593a226a8e8eea5018db7c1aaf57768b01011b558dd4f2c068",
    ),
    (
        "portable",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "33bd5392eb2fefc2c55859dbae8c3f90d863a542ef6a793d96c442e82bf90b5d",
    ),
    (
        "portable",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "10bd2d597635bd553a221ea46a6e643c0db73322a124d946dafee6c11c0c4d92",
    ),
    (
        "portable",
        4,
        "epikv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "de5ad0113454b5ab5fa84538418c53f582d46c1dcecfb89824c38b7f373ec8c7",
    ),
    (
        "portable",
        4,
        "epikv-lag",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "6aa502b085fad0058e6682a911fdd0ed39c5903ab5030a4238afd67b91bcb84a",
    ),
    (
        "avx512",
        0,
        "full",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "bbb2a751cdf1ac54bfe1dc67a0dee30f7c4716fb88f30c20896a276bf2a36a38",
    ),
    (
        "avx512",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "d51793eae072fa1114dcba6df58871c61588ee944dce0d5e38996f679eb0331a",
    ),
    (
        "avx512",
        0,
        "h2o",
        "c4ae698e22eb3b8aef2c51e0fd111894cab8c53fcaa5daf8315631d633d2fb5d",
        "ded6b5f1a4bf89fb1888a2708b4ebeb51f21fc77ed18b943a5a9ccda47130767",
    ),
    (
        "avx512",
        0,
        "snapkv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "6084a2479ec884102f4cf07021e03c55c5768369c3299e7d690e87550e9bf3da",
    ),
    (
        "avx512",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "c0fb7c926967e23b04db40f5de65ac30a636734d76c2bdfca05a43b2783dd995",
    ),
    (
        "avx512",
        0,
        "epikv",
        "ea006ed665c33e5d4e74770feff599291f59e49f59dbc730a21577e9fac48727",
        "14338e0196a58bd1c9e55cce37bd23801ed7de702ed88dc6e73ff5f0d7a9ea8d",
    ),
    (
        "avx512",
        0,
        "epikv-lag",
        "72cb16be001caac62ae39fb3011484860a70887993ffd985233033fcdeda3e8f",
        "dea618f2322db4b387a4aa09f9527c78bed5c0451e18e6a0b9209a6b3bbce902",
    ),
    (
        "avx512",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "00bda1dac3f568d366b01768a997a2e6fe24824475b6a79c775aacb7e3d4e74d",
    ),
    (
        "avx512",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "6307bce4d721ca728de113846d99d1db0b30d588a506fa7dfad857209ddc206f",
    ),
    (
        "avx512",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "e69682f057a5a41f63c424d57d85907e0a7b3518e77e8bf840d80025691d8ffe",
    ),
    (
        "avx512",
        1,
        "snapkv",
        "9612037925f8ffae547e6d1dee77419cbc43ed049fa37f87a0472a808077cca5",
        "d9b2a8cc1e121dd69ee82c6b1c0c9117abefbb3f6c58ec80c1423b176f2e1ccd",
    ),
    (
        "avx512",
        1,
        "adakv",
        "ba8fa4364428f628ca295ea8d03aa2a21f5a25f773eb80bb4bcee2e1de731ff6",
        "cde4295eab10d43a93a044cf25ae56263e1f780f6bf01209711ae7cfa185f93b",
    ),
    (
        "avx512",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "cded4d92fd7e5fea975d4e3a4cd4d0406cc99491d797380b8b8770b3b5049571",
    ),
    (
        "avx512",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "04d356bb5e4c2bb3948f997d5617466df265ca7d01c68d42c6071582f6381081",
    ),
    (
        "avx512",
        2,
        "full",
        "bb78243c384bfdf03d86fa9cc04435f5779e76f53156308bf2f0359698bd099a",
        "ae2cd467dc161364b4afb6fd77ab5787429591df18370291eedaea896483d23e",
    ),
    (
        "avx512",
        2,
        "window",
        "a7b13f173bf03344ea55b34a7c16ca965bcadfc397c1564dfb8ed57d360faf8f",
        "0b6b2e20028c71e0f2d793f885d6fc18c95f22968d441906a34d03d79ea0cb7c",
    ),
    (
        "avx512",
        2,
        "h2o",
        "6e9da447c0c41f22a4305c5bfd7fa01294770bb96db7f32ce871282e9ab8a61f",
        "b5aff9d7573ddb8c6a469b830c03a5a87f20b5139fcdb50c2ac5c4f57d70449a",
    ),
    (
        "avx512",
        2,
        "snapkv",
        "cd310631f3677ec65b52307d8716d6a540897507f86911bb040d292754544c72",
        "a02f2c45d574b3e883723ab198ce920ba500e31b1eac368b3222e6757db6a2b4",
    ),
    (
        "avx512",
        2,
        "adakv",
        "cb89d96181a888e9ca942aaa785c3914929ebb56e65dbbec9c4400102d7ea0b8",
        "842e131482021c122233d659ac6b05bc6c3d6e83432867cace56898123db2b34",
    ),
    (
        "avx512",
        2,
        "epikv",
        "af806138fbd22d4b7cc8e7122fcf664ae285f9aaabe93ee1c14a9bca586c6b0c",
        "ada0800ab0b1db99201086f5621bee8a06b0ac90daf7ee8029088d70344bb049",
    ),
    (
        "avx512",
        2,
        "epikv-lag",
        "52ddf992fb12e9509226b87716576e282af35d773bbc21234b659eaed91c7c96",
        "acacc11c52d966880432766704a7dd73d775708ad32444356653e5650b7e11b2",
    ),
    (
        "avx512",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "1b14b0aac44ba0cc889dc155190000897c532840c3dffe5835ad3c9a50418ee0",
    ),
    (
        "avx512",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "8c044d2fb6a37d3b002f8313cca619b67aefa579da7e00be4f651ed9ececfe62",
    ),
    (
        "avx512",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e4a767aa239ff679317f5fe48b194705a03d286e2c44617bda67480e921dd4e0",
    ),
    (
        "avx512",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "0e3d24b70819ba429117700ea86ecbb7cdf48a34d82a8eaf77f712343c1410c4",
    ),
    (
        "avx512",
        3,
        "adakv",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "2dc15d57a901a601e600661f87a732c3ba1fce6aa11c5376242c3757c02204f9",
    ),
    (
        "avx512",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "15143e0973ca21da086e34c8619279ba822107ae5df8711bf6efcba98703b116",
    ),
    (
        "avx512",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "ec949f08f6417f2f8c34c1c6113ce173f7a703794df8ca1b379afec193fc155e",
    ),
    (
        "avx512",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "6353247ccb9f478495841d8145dc8cafad2b085d3f82f3a82cf510e833237d7d",
    ),
    (
        "avx512",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "96cad3d69c02e21546c07ae51606be63786bf387609c10bc04b9c373fd65143f",
    ),
    (
        "avx512",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "d053993d73c2b3ca4781f2ccd37379807f263b7dd03a70ac2528cac85ebb060c",
    ),
    (
        "avx512",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "bf35eaf886e768ad59d79ff79ec06e7bb8e1ac32298ed2355c4c3bca864a71be",
    ),
    (
        "avx512",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0c44d57b6d64938b3a385821498d5a5d3673c58cf36f002b1a44db78b989af32",
    ),
    (
        "avx512",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "6f744ad7b27cd572df82b1342b10e513b3829ebe01ac5ee3b71dcdb071795bc4",
    ),
    (
        "avx512",
        4,
        "epikv-lag",
        "a82916c36340225d21497e432a83f2886935e287b9aeacbddae8678d9d01d2b2",
        "647239a4987e1bcf3ff738251892f5fe750b45dfbaa8b4e85030abe227d23ffb",
    ),
    (
        "avx512-vnni",
        0,
        "full",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "bbb2a751cdf1ac54bfe1dc67a0dee30f7c4716fb88f30c20896a276bf2a36a38",
    ),
    (
        "avx512-vnni",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "d51793eae072fa1114dcba6df58871c61588ee944dce0d5e38996f679eb0331a",
    ),
    (
        "avx512-vnni",
        0,
        "h2o",
        "c4ae698e22eb3b8aef2c51e0fd111894cab8c53fcaa5daf8315631d633d2fb5d",
        "ded6b5f1a4bf89fb1888a2708b4ebeb51f21fc77ed18b943a5a9ccda47130767",
    ),
    (
        "avx512-vnni",
        0,
        "snapkv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "6084a2479ec884102f4cf07021e03c55c5768369c3299e7d690e87550e9bf3da",
    ),
    (
        "avx512-vnni",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "c0fb7c926967e23b04db40f5de65ac30a636734d76c2bdfca05a43b2783dd995",
    ),
    (
        "avx512-vnni",
        0,
        "epikv",
        "ea006ed665c33e5d4e74770feff599291f59e49f59dbc730a21577e9fac48727",
        "14338e0196a58bd1c9e55cce37bd23801ed7de702ed88dc6e73ff5f0d7a9ea8d",
    ),
    (
        "avx512-vnni",
        0,
        "epikv-lag",
        "72cb16be001caac62ae39fb3011484860a70887993ffd985233033fcdeda3e8f",
        "dea618f2322db4b387a4aa09f9527c78bed5c0451e18e6a0b9209a6b3bbce902",
    ),
    (
        "avx512-vnni",
        1,
        "full",
        "e1390660113518a402e025b003804c5d94c8eda7ba909be1bcbb4ac5b25aae0c",
        "00bda1dac3f568d366b01768a997a2e6fe24824475b6a79c775aacb7e3d4e74d",
    ),
    (
        "avx512-vnni",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "6307bce4d721ca728de113846d99d1db0b30d588a506fa7dfad857209ddc206f",
    ),
    (
        "avx512-vnni",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "e69682f057a5a41f63c424d57d85907e0a7b3518e77e8bf840d80025691d8ffe",
    ),
    (
        "avx512-vnni",
        1,
        "snapkv",
        "9612037925f8ffae547e6d1dee77419cbc43ed049fa37f87a0472a808077cca5",
        "d9b2a8cc1e121dd69ee82c6b1c0c9117abefbb3f6c58ec80c1423b176f2e1ccd",
    ),
    (
        "avx512-vnni",
        1,
        "adakv",
        "ba8fa4364428f628ca295ea8d03aa2a21f5a25f773eb80bb4bcee2e1de731ff6",
        "cde4295eab10d43a93a044cf25ae56263e1f780f6bf01209711ae7cfa185f93b",
    ),
    (
        "avx512-vnni",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "cded4d92fd7e5fea975d4e3a4cd4d0406cc99491d797380b8b8770b3b5049571",
    ),
    (
        "avx512-vnni",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "04d356bb5e4c2bb3948f997d5617466df265ca7d01c68d42c6071582f6381081",
    ),
    (
        "avx512-vnni",
        2,
        "full",
        "bb78243c384bfdf03d86fa9cc04435f5779e76f53156308bf2f0359698bd099a",
        "ae2cd467dc161364b4afb6fd77ab5787429591df18370291eedaea896483d23e",
    ),
    (
        "avx512-vnni",
        2,
        "window",
        "a7b13f173bf03344ea55b34a7c16ca965bcadfc397c1564dfb8ed57d360faf8f",
        "0b6b2e20028c71e0f2d793f885d6fc18c95f22968d441906a34d03d79ea0cb7c",
    ),
    (
        "avx512-vnni",
        2,
        "h2o",
        "6e9da447c0c41f22a4305c5bfd7fa01294770bb96db7f32ce871282e9ab8a61f",
        "b5aff9d7573ddb8c6a469b830c03a5a87f20b5139fcdb50c2ac5c4f57d70449a",
    ),
    (
        "avx512-vnni",
        2,
        "snapkv",
        "cd310631f3677ec65b52307d8716d6a540897507f86911bb040d292754544c72",
        "a02f2c45d574b3e883723ab198ce920ba500e31b1eac368b3222e6757db6a2b4",
    ),
    (
        "avx512-vnni",
        2,
        "adakv",
        "cb89d96181a888e9ca942aaa785c3914929ebb56e65dbbec9c4400102d7ea0b8",
        "842e131482021c122233d659ac6b05bc6c3d6e83432867cace56898123db2b34",
    ),
    (
        "avx512-vnni",
        2,
        "epikv",
        "af806138fbd22d4b7cc8e7122fcf664ae285f9aaabe93ee1c14a9bca586c6b0c",
        "ada0800ab0b1db99201086f5621bee8a06b0ac90daf7ee8029088d70344bb049",
    ),
    (
        "avx512-vnni",
        2,
        "epikv-lag",
        "52ddf992fb12e9509226b87716576e282af35d773bbc21234b659eaed91c7c96",
        "acacc11c52d966880432766704a7dd73d775708ad32444356653e5650b7e11b2",
    ),
    (
        "avx512-vnni",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "1b14b0aac44ba0cc889dc155190000897c532840c3dffe5835ad3c9a50418ee0",
    ),
    (
        "avx512-vnni",
        3,
        "window",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "8c044d2fb6a37d3b002f8313cca619b67aefa579da7e00be4f651ed9ececfe62",
    ),
    (
        "avx512-vnni",
        3,
        "h2o",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "e4a767aa239ff679317f5fe48b194705a03d286e2c44617bda67480e921dd4e0",
    ),
    (
        "avx512-vnni",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "0e3d24b70819ba429117700ea86ecbb7cdf48a34d82a8eaf77f712343c1410c4",
    ),
    (
        "avx512-vnni",
        3,
        "adakv",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "2dc15d57a901a601e600661f87a732c3ba1fce6aa11c5376242c3757c02204f9",
    ),
    (
        "avx512-vnni",
        3,
        "epikv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "15143e0973ca21da086e34c8619279ba822107ae5df8711bf6efcba98703b116",
    ),
    (
        "avx512-vnni",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "ec949f08f6417f2f8c34c1c6113ce173f7a703794df8ca1b379afec193fc155e",
    ),
    (
        "avx512-vnni",
        4,
        "full",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "6353247ccb9f478495841d8145dc8cafad2b085d3f82f3a82cf510e833237d7d",
    ),
    (
        "avx512-vnni",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "96cad3d69c02e21546c07ae51606be63786bf387609c10bc04b9c373fd65143f",
    ),
    (
        "avx512-vnni",
        4,
        "h2o",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "d053993d73c2b3ca4781f2ccd37379807f263b7dd03a70ac2528cac85ebb060c",
    ),
    (
        "avx512-vnni",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "bf35eaf886e768ad59d79ff79ec06e7bb8e1ac32298ed2355c4c3bca864a71be",
    ),
    (
        "avx512-vnni",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "0c44d57b6d64938b3a385821498d5a5d3673c58cf36f002b1a44db78b989af32",
    ),
    (
        "avx512-vnni",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "6f744ad7b27cd572df82b1342b10e513b3829ebe01ac5ee3b71dcdb071795bc4",
    ),
    (
        "avx512-vnni",
        4,
        "epikv-lag",
        "a82916c36340225d21497e432a83f2886935e287b9aeacbddae8678d9d01d2b2",
        "647239a4987e1bcf3ff738251892f5fe750b45dfbaa8b4e85030abe227d23ffb",
    ),
    (
        "avx2",
        0,
        "full",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "bca0fceab251470740b0e6714db12a924ba0ae1fcd133ab8660987bc3424b9c1",
    ),
    (
        "avx2",
        0,
        "window",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "591db3244b103708920f4ab44c82f5e1e43d97d5116961926c21ecef0e26ecf6",
    ),
    (
        "avx2",
        0,
        "h2o",
        "cb91e5f653fbe6dcf323a03369f5b57a08bf89f70e774340301a55b6567a9408",
        "b73a21eeabb300ac8887c47dd2c0003ceb6cb20ede3d11c6af20cd1b2fd0fff2",
    ),
    (
        "avx2",
        0,
        "snapkv",
        "398802cbf0eb6ae70d44ad99dc542bd14b80bfccb74947f38fe5d2fe6388fb08",
        "f332fcdf51e64b698dac5131e2d8db3fe17ad14b86448a7e5b2550472c6a3024",
    ),
    (
        "avx2",
        0,
        "adakv",
        "697f31d5816026fa77a20528bb5d0ab50971fd13cffd0e0ccc1fcf4ff091cf27",
        "5acd5b8225ea04063d54d4db23952f230991da68cdfaf34af726b61b124794f3",
    ),
    (
        "avx2",
        0,
        "epikv",
        "4e9c6620dd5f118eed766ce687742a66e9824622accb6be3404168a71ed69a98",
        "06072c70a6f22e48a89c394b9b780c3cbc6b70bb8b71ae788d40f9d8bde3723f",
    ),
    (
        "avx2",
        0,
        "epikv-lag",
        "5ed99b880e5eefbea36cab5d4df0d67ca393db4dcf2f448823e175a3375f65c3",
        "a3d991c36b506c252ab590c89fe98fdd1b30572b7c87c6e7ebcd4970b6ab207f",
    ),
    (
        "avx2",
        1,
        "full",
        "1ded7c76ae0f116edb1cc4fe4d0ba1dd6e3e156025fbcb5f9a1a9bfc3a9ede52",
        "f7300679835e506a818dd4a4a8e76dfea439b2cba08a28cec4fafca476e3a136",
    ),
    (
        "avx2",
        1,
        "window",
        "df5a7e4be30d63352b633d33e1490c9c003bd84ac7d8367d81b4057d21c163bb",
        "5351b4c81b2c134525fa9b64ff30a9b8a935c47539bef7385f035d1b1b5c231e",
    ),
    (
        "avx2",
        1,
        "h2o",
        "4521404ac4e4566224fe3367b528bf3781c1632f7533200872e95bf30e06adde",
        "194d530d61808cab2c45816143487257e7a29a85825d14060d3c7232fc322c30",
    ),
    (
        "avx2",
        1,
        "snapkv",
        "efec61a00e058df9df6dfb894a1c06cb636717131f21ed53abf2ce39a824e2d9",
        "c44ce8dbaec93217277e235e67bd66bc85683a23e3bb57bc969e38c15831e224",
    ),
    (
        "avx2",
        1,
        "adakv",
        "ffa89a2511f7e3b9602fe4b9f826742a510a7dd8bc32d8f82f68b78af915e159",
        "f66fe20a81c889121fca7edcc7fc33e32a5c01af8cf7e255dffd4b648a2333b2",
    ),
    (
        "avx2",
        1,
        "epikv",
        "ef84cdc985263b78aee558a2e1887c97ad932a18ff1e2b15ac8f34f23ebcb359",
        "11b8e5404c54ad0d8c801d555467c84bebeff2148bbcc8bff5e56c921f8a9a6d",
    ),
    (
        "avx2",
        1,
        "epikv-lag",
        "9098deb2bcdbc444707efd31d1dbbb73a65086e934ba306ae3f33375a8a6b7f3",
        "31587b7d49386c8b32e2bf53d2399bbae0f38443f6d2f982ce8208c06da284c5",
    ),
    (
        "avx2",
        2,
        "full",
        "d62081c4e208361b39dac6bd5828481b8a1f3315afd3eaacbd8418eb2d05cdcb",
        "d4cb761dbc9583232272823e323407b942129a64932bb813a5ba9d01be551a4e",
    ),
    (
        "avx2",
        2,
        "window",
        "02a1164f379ff668479562bce0a48eff80e6d7626db0c26d9064407a85051760",
        "78725ba58892d744ae0680c759b71a1aee59e1a677598de1c46884bc3db54638",
    ),
    (
        "avx2",
        2,
        "h2o",
        "da40aac8cef9945f08ad438bc0a2e1ad4fd11f6f8ac506f2d0ac829fbd42432a",
        "cb73977b5609c4e0f4b4b91a412511dfc5b691edab302710d71d930003ff9c91",
    ),
    (
        "avx2",
        2,
        "snapkv",
        "a89e28cef99175343ec39c0e78a64dc1d3146d23f4f864457d5e5c416590aefe",
        "a9189468feb9f2f06d94064a05b3007355ed4a0b2b7dd3d0338dfdee4a73f928",
    ),
    (
        "avx2",
        2,
        "adakv",
        "d62081c4e208361b39dac6bd5828481b8a1f3315afd3eaacbd8418eb2d05cdcb",
        "778994854811aa00996ad8bbbfcf0bcad76bbeb622231d44c1850401bdb85f2a",
    ),
    (
        "avx2",
        2,
        "epikv",
        "3c9286216090bb61b427f5c80b3354e80981ae59259e3cf1d758fc86491ebda1",
        "db7b392a66d40a381cf87366705ed1048dfc8ea91b6e02b31f530b383752babb",
    ),
    (
        "avx2",
        2,
        "epikv-lag",
        "6a64476bead1e5af95f90829276de3e1bd466fc441d4eb91b69fb468307fb7b6",
        "e1f45371310aa7c3dffb4e88246f753d69d324700642df8944e5517135b252bf",
    ),
    (
        "avx2",
        3,
        "full",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "6eded4c56b82b284e8b5838e7e1b9d5470de2c70eedcff8d593362d169e812bc",
    ),
    (
        "avx2",
        3,
        "window",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "f9fa905d1d5f33fa0f8a49f242afe8fb63b8cd5f15479923c011da39baa40e71",
    ),
    (
        "avx2",
        3,
        "h2o",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "e4905f4fedca6773f2ab8cc308085bc6816d523e7e75289ed43eaef0abfd05ff",
    ),
    (
        "avx2",
        3,
        "snapkv",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "0e840c2b13af4285af31a411a92e9c221fa00f1a0d0c41932e17edd51002fade",
    ),
    (
        "avx2",
        3,
        "adakv",
        "27c8c2406e6eff77c9f1b382ca444786806991fc36829402637681a9e9b66448",
        "cde568b621f21305b17b2fcc4a1eedc217daca9ab98df5160d7528359d756c98",
    ),
    (
        "avx2",
        3,
        "epikv",
        "788266fb8e396aa9f2e78f82a9a144e83de6b7f3ef781279aa137844661225b1",
        "8bed434cc76c22a61f0daeee04861c7e411786291b80e2bbdbffe033003e5d26",
    ),
    (
        "avx2",
        3,
        "epikv-lag",
        "318c80b5aae01e5a95094de02978388f6477a483a3d76872cf6bd1bc5c4c2c72",
        "8b3f666417301cef0c9a5411c5160ce760279587d9a67c9d292e142898a20329",
    ),
    (
        "avx2",
        4,
        "full",
        "1b50d118dc39126cda266f05d2d468ba5fb316b9161e8996bb383db18babc8f2",
        "e07eb57113188a8d27ac5b619688cdbeeb9903da0b0584c8ec1412c314ce1907",
    ),
    (
        "avx2",
        4,
        "window",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "341a15e63bd3470b9598a47ba293861c390b5bd0abe610ce7de5c8b26605b797",
    ),
    (
        "avx2",
        4,
        "h2o",
        "b1034158367c2939d75ed85271d98eeeeea6965850f25de7c42bd3c213ed4271",
        "f81f9fab47dfadd0f48a6fdb7b529edd3eba3c44bb907740f692ae4ece35d4eb",
    ),
    (
        "avx2",
        4,
        "snapkv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "98bbcd34d36e9fa4c4041e2321020ed8f86af335245cbc7a13c867f307fef59d",
    ),
    (
        "avx2",
        4,
        "adakv",
        "a6118d2b38f905e1a2508f4aeb7c90811f44ba86247101ec4a154af3fe402a1a",
        "895f57dbafa8cccaf07356b4a40ba63e2c35a29ae985f4963729f098d0ea64f5",
    ),
    (
        "avx2",
        4,
        "epikv",
        "b0f767be040b03da165dbab617c3a0d79e9bbbb68f5adcbc73261fbaf97101aa",
        "7fda67dd038cae74d0a8bcd45e23d737af147da34917974bf0a100e0ff7229f0",
    ),
    (
        "avx2",
        4,
        "epikv-lag",
        "ba6e50717d320c300079c709f61808ae816e3f9cbeae7d41293104a407bf3329",
        "d4295fea0a889a91aafc9eb8114e355e426c055299592c93f90dfaaf738811ce",
    ),
];

/// Greedy run of `prompt` under `policy`: (token hash, logits hash).
fn run_case<'w>(
    w: &'w Weights<'w>,
    model: &std::path::Path,
    ids: &[u32],
    policy: &str,
    threads: usize,
) -> (String, String) {
    let mut args = vec!["t".to_string(), "--policy".into(), policy.into()];
    if policy != "full" {
        args.extend(["--kv-budget".into(), BUDGET.to_string()]);
    }
    let f = Flags::parse_from(args);
    let n_ctx = ids.len() + N_GEN + 1;
    let mut s =
        f.kv.session(w, 7, model, n_ctx, threads, 32, ids.len())
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
    let mut lh = Sha256::new();
    let mut toks: Vec<u32> = Vec::new();
    let logits = s.feed(ids, Logits::All).unwrap().to_vec();
    for x in &logits {
        lh.update(x.to_le_bytes());
    }
    let vocab = w.config.vocab;
    let mut last = logits[logits.len() - vocab..].to_vec();
    for _ in 0..N_GEN {
        let t = argmax(&last);
        toks.push(t);
        last = s.feed(&[t], Logits::Last).unwrap().to_vec();
        for x in &last {
            lh.update(x.to_le_bytes());
        }
    }
    if policy != "full" {
        assert!(s.n_evicted > 0, "{policy}: the budget never evicted");
    }
    let mut th = Sha256::new();
    for t in &toks {
        th.update(t.to_le_bytes());
    }
    (hex(&th.finalize()), hex(&lh.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn greedy_tokens_and_logits_match_the_recorded_hashes() {
    let path = util::default_model();
    let g = Gguf::open(&path).unwrap();
    let w = Weights::from_gguf(&g).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    util::rerun_at_lower_levels("identity::greedy_tokens_and_logits_match_the_recorded_hashes");
    let prof = util::kernel_profile();
    let recorded: Vec<_> = RECORDED.iter().filter(|r| r.0 == prof).collect();
    let mut lines = Vec::new();
    let mut mismatches = Vec::new();
    for (pi, p) in PROMPTS.iter().enumerate() {
        let ids = tok.encode(p, true, false).unwrap();
        for pol in POLICIES {
            let (th, lh) = run_case(&w, &path, &ids, pol, 1);
            lines.push(format!(
                "    (\"{prof}\", {pi}, \"{pol}\", \"{th}\", \"{lh}\"),"
            ));
            match recorded.iter().find(|r| r.1 == pi && r.2 == pol) {
                Some(r) => {
                    if r.3 != th || r.4 != lh {
                        mismatches.push(format!(
                            "prompt {pi} {pol}: tokens {} logits {}",
                            if r.3 == th { "same" } else { "DIFFER" },
                            if r.4 == lh { "same" } else { "DIFFER" }
                        ));
                    }
                }
                None => {
                    // no record for this profile: self-consistency only
                    assert_eq!(
                        run_case(&w, &path, &ids, pol, 1),
                        (th.clone(), lh.clone()),
                        "prompt {pi} {pol}: two runs differ"
                    );
                    assert_eq!(
                        run_case(&w, &path, &ids, pol, 2),
                        (th, lh),
                        "prompt {pi} {pol}: 1 and 2 threads differ"
                    );
                }
            }
        }
    }
    eprintln!("hashes for profile {prof}:\n{}", lines.join("\n"));
    if recorded.is_empty() {
        eprintln!("no hashes recorded for kernel profile {prof}: checked self-consistency only");
    } else {
        assert_eq!(
            recorded.len(),
            PROMPTS.len() * POLICIES.len(),
            "incomplete record for {prof}"
        );
    }
    assert!(mismatches.is_empty(), "changed: {mismatches:#?}");
}
